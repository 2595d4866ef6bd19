"""The unit-test harness: runs in the sandbox as a job's main process (standard library only).

The tests and the solution run in two processes. This one (the harness) holds the tests and
writes the report; the solution runs in a child process (`harness.py solve`), and the tests call
its functions through a pipe. What crosses is plain data only (None, bool, int, float, complex,
str, bytes, bytearray, and lists, tuples, dicts, sets and frozensets of them), rebuilt here as
builtin values: a solution cannot hand the tests an object whose `__eq__` says yes to anything,
reach into the harness's frames, read the report's nonce or write the report, because none of it
is in its process. The harness makes itself non-dumpable before the solution starts, so the
solution's process, though the same uid, can neither ptrace it nor read its memory or its file
descriptors through /proc; and tests.py is removed from the scratch directory before the solution
starts, so the solution cannot read the tests either.

The tests see the functions and plain-data constants the solution defines, except names of
builtins (a solution's `abs` or `sorted` would stand in for the ones the tests use) and names
starting with `_`. Return values of other kinds (generators, ranges, instances of the solution's
classes) fail the test, as would a task whose tests need the solution's classes or callbacks:
such tasks do not fit this harness. Calls pass their arguments by value; afterwards the lists,
dicts, sets and bytearrays passed are updated in place to what the solution left in them (so
tests of in-place functions work).
Exceptions come back as the builtin exception of the same name (ValueError, KeyError...) or as
SolutionError; a value that is not plain data fails the test (UnsupportedValue). Each test has a
share of the time budget: a solution that does not answer in time fails that test as a timeout
and is started again for the next; one that dies fails it as a crash. Timeouts, crashes and
unsupported values are BaseExceptions, so a test's `except Exception` (or `except TypeError`)
cannot swallow them.

Stdin: the nonce line, then a JSON line of settings ({"budget_s": seconds}). Stdout: only the
report, after the nonce. The solution's own output goes to stderr.
"""

import ast
import builtins
import json
import os
import select
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
MAX_DEPTH = 100
MAX_ANSWER_BYTES = 32 * 1024 * 1024
SHADOWS = frozenset(vars(builtins))  # names a solution may not give the tests


# -- plain values across the process boundary ---------------------------------------------------

def encode(value, depth=0):
    """JSON-able form of a plain value; TypeError for anything else. Subclasses of the builtin
    types (Counter, OrderedDict, namedtuple...) cross as their base type, rebuilt by value, so
    whatever they override stays behind."""
    if depth > MAX_DEPTH:
        raise TypeError("a value nested too deeply")
    if value is None or type(value) is bool:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, float):
        return {"f": repr(float(value))}
    if isinstance(value, complex):
        return {"c": [repr(value.real), repr(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {"ba" if isinstance(value, bytearray) else "b": bytes(value).hex()}
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]}
    for kind, tag in ((list, None), (tuple, "t"), (frozenset, "fs"), (set, "s")):
        if isinstance(value, kind):
            items = [encode(item, depth + 1) for item in kind.__iter__(value)]
            return items if tag is None else {tag: items}
    raise TypeError(f"{type(value).__name__!r}, which is not plain data")


def decode(data, depth=0):
    """The builtin value `data` stands for; ValueError when it is not one of encode's forms."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    if data is None or type(data) in (bool, int, str):
        return data
    if type(data) is list:
        return [decode(item, depth + 1) for item in data]
    if type(data) is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "f" and type(body) is str:
            return float(body)
        if tag == "c" and type(body) is list and len(body) == 2 and all(type(p) is str for p in body):
            return complex(float(body[0]), float(body[1]))
        if tag in ("t", "s", "fs") and type(body) is list:
            items = [decode(item, depth + 1) for item in body]
            return {"t": tuple, "s": set, "fs": frozenset}[tag](items)
        if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
        if tag in ("b", "ba") and type(body) is str:
            return (bytes if tag == "b" else bytearray).fromhex(body)
    raise ValueError("not a plain value")


def describe(exc):
    return (type(exc).__name__ + ": " + str(exc))[:300]


# -- the solution's side ------------------------------------------------------------------------

def solve(request_fd, answer_fd):
    requests, answers = os.fdopen(request_fd, "rb"), os.fdopen(answer_fd, "wb")

    def send(message):
        answers.write((json.dumps(message) + "\n").encode())
        answers.flush()

    namespace = {"__name__": "solution"}
    try:
        exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - whatever the solution does is reported
        send({"loaded": False, "error": describe(exc)})
        return
    functions, values = [], {}
    for name, value in namespace.items():
        if name.startswith("_") or name in SHADOWS:
            continue  # never a stand-in for a builtin the tests use (abs, sorted, all, range...)
        if callable(value):
            functions.append(name)
        else:
            try:
                values[name] = encode(value)
            except TypeError:
                pass  # modules and other objects stay on this side
    send({"loaded": True, "functions": functions, "values": values})
    for line in requests:
        request = json.loads(line)
        args = [decode(a) for a in request["args"]]
        kwargs = {k: decode(v) for k, v in request["kwargs"].items()}
        try:
            result = namespace[request["call"]](*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001
            send({"raised": type(exc).__name__, "message": str(exc)[:300]})
            continue
        try:
            send({"returned": encode(result), "args": [encode(a) for a in args]})
        except TypeError as exc:
            send({"unsupported": str(exc)})


# -- the tests' side ----------------------------------------------------------------------------

class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one."""


class SolutionTimeout(BaseException):
    pass


class SolutionCrashed(BaseException):
    pass


class UnsupportedValue(BaseException):
    """A value that is not plain data was to cross (a BaseException: a test expecting the
    solution's TypeError must not take this for it)."""


class Solution:
    """The solution's process, started on demand, with calls bounded by `deadline`."""

    def __init__(self):
        self.process = None
        self.deadline = 0.0
        self.functions, self.values = [], {}
        self.load_error = ""
        self.buffer = bytearray()

    def start(self):
        requests_read, requests_write = os.pipe()
        answers_read, answers_write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(sys.argv[0]), "solve", str(requests_read), str(answers_write)],
                stdin=subprocess.DEVNULL, stdout=2, pass_fds=(requests_read, answers_write))
        except OSError as exc:  # e.g. what the last one left running holds every process the job may have
            for fd in (requests_read, requests_write, answers_read, answers_write):
                os.close(fd)
            self.process, self.load_error = None, "the solution could not be started: " + describe(exc)
            return False
        finally:
            if self.process is not None:
                os.close(requests_read)
                os.close(answers_write)
        self.requests, self.answers, self.buffer = requests_write, answers_read, bytearray()
        try:
            hello = self.receive()
        except SolutionTimeout:
            self.load_error = "the solution did not finish loading in time"
            return False
        except SolutionCrashed as exc:
            self.load_error = str(exc)
            return False
        if type(hello) is not dict or hello.get("loaded") is not True:
            error = hello.get("error") if type(hello) is dict else None
            self.load_error = error if type(error) is str else "the solution did not load"
            self.stop()
            return False
        functions, values = hello.get("functions"), hello.get("values")
        try:
            if type(functions) is not list or not all(type(f) is str for f in functions) or type(values) is not dict:
                raise ValueError("malformed")
            self.functions = [f for f in functions if not f.startswith("_") and f not in SHADOWS]
            self.values = {k: decode(v) for k, v in values.items()
                           if type(k) is str and not k.startswith("_") and k not in SHADOWS}
        except Exception:  # noqa: BLE001 - whatever was wrong with it
            self.load_error = "the solution's process answered malformed data"
            self.stop()
            return False
        return True

    @property
    def alive(self):
        return self.process is not None and self.process.poll() is None

    def stop(self):
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
            for fd in (self.requests, self.answers):
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.process = None

    def receive(self):
        scanned = 0
        while (end := self.buffer.find(b"\n", scanned)) < 0:
            scanned = len(self.buffer)
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.answers], [], [], left)[0]:
                self.stop()
                raise SolutionTimeout("the solution did not answer in time")
            chunk = os.read(self.answers, 1 << 16)
            if not chunk:
                process = self.process
                self.stop()  # it closed its answers: alive or not, it is done
                raise SolutionCrashed(f"the solution's process ended (exit code {process.returncode})")
            self.buffer += chunk
            if len(self.buffer) > MAX_ANSWER_BYTES:
                self.stop()
                raise SolutionCrashed("the solution answered more than the harness takes")
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        try:
            return json.loads(line)
        except Exception:  # noqa: BLE001 - malformed, or nested past the parser's recursion limit
            self.stop()
            raise SolutionCrashed("the solution's process answered malformed data") from None

    def call(self, name, args, kwargs):
        if not self.alive:
            raise SolutionCrashed("the solution is not running")
        try:
            request = {"call": name, "args": [encode(a) for a in args],
                       "kwargs": {str(k): encode(v) for k, v in kwargs.items()}}
        except TypeError as exc:
            raise UnsupportedValue(f"{name}() was passed {exc}") from None
        try:
            os.write(self.requests, (json.dumps(request) + "\n").encode())
        except OSError:
            self.stop()
            raise SolutionCrashed("the solution's process is gone") from None
        answer = self.receive()
        if type(answer) is not dict:
            self.stop()
            raise SolutionCrashed("the solution's process answered malformed data")
        if "raised" in answer:
            name_raised, message = str(answer["raised"]), str(answer.get("message", ""))
            builtin = getattr(builtins, name_raised, None)
            if isinstance(builtin, type) and issubclass(builtin, Exception):
                raise builtin(message)
            raise SolutionError(f"{name_raised}: {message}")
        if "unsupported" in answer:
            raise UnsupportedValue(f"{name}() returned {answer['unsupported']}")
        try:
            result = decode(answer["returned"])
            after = [decode(a) for a in answer["args"]]
            if len(after) != len(args):
                raise ValueError("not one value per argument")
        except Exception:  # noqa: BLE001 - whatever was wrong with it
            self.stop()
            raise SolutionCrashed("the solution's process answered malformed data") from None
        for before, now in zip(args, after, strict=True):
            update_in_place(before, now)
        return result


def update_in_place(original, now):
    """What an in-place function did to an argument, done to the caller's object."""
    if type(original) is not type(now):
        return
    if type(original) in (list, bytearray):
        original[:] = now
    elif type(original) in (dict, set):
        original.clear()
        original.update(now)


def proxy(solution, name):
    def call(*args, **kwargs):
        return solution.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def protect_this_process():
    """Non-dumpable: a process of the same uid can no longer ptrace this one or open its
    /proc/<pid>/mem, fd or environ."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def run_tests():
    nonce = sys.stdin.readline().strip()
    settings = json.loads(sys.stdin.readline() or "{}")
    report_fd = os.dup(1)
    os.dup2(2, 1)  # anything else printed here goes to stderr: stdout carries only the report
    end = time.monotonic() + float(settings.get("budget_s", 10.0))
    protect_this_process()
    test_source = open("tests.py").read()
    os.unlink("tests.py")
    names = sorted({node.name for node in ast.parse(test_source).body
                    if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")})
    report = {"compiled": False, "error": "", "tests": [], "restarts": 0}
    solution = Solution()
    solution.deadline = end
    if not solution.start():
        report["error"] = solution.load_error[:500]
    else:
        report["compiled"] = True
        tests = dict(solution.values)
        tests.update({name: proxy(solution, name) for name in solution.functions})
        tests["__name__"] = "tests"
        try:
            exec(compile(test_source, "tests.py", "exec"), tests)
        except BaseException as exc:  # noqa: BLE001 - e.g. a call at the top of tests.py timed out
            names, report["error"] = [], "tests.py: " + describe(exc)
        for index, name in enumerate(names):
            solution.deadline = time.monotonic() + max(0.0, end - time.monotonic()) / (len(names) - index)
            if not solution.alive:
                report["restarts"] += 1
                if not solution.start():
                    report["tests"].append([name, False, "the solution could not be started again: "
                                            + solution.load_error[:200], "crash"])
                    continue
            try:
                tests[name]()
                report["tests"].append([name, True, "", "passed"])
            except SolutionTimeout as exc:
                report["tests"].append([name, False, str(exc), "timeout"])
            except SolutionCrashed as exc:
                report["tests"].append([name, False, str(exc), "crash"])
            except BaseException as exc:  # noqa: BLE001 - a failing test, whatever it raised
                report["tests"].append([name, False, describe(exc)[:200], "failed"])
        solution.stop()
    os.write(report_fd, ("\n" + nonce + " " + json.dumps(report) + "\n").encode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["solve"]:
        solve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        run_tests()
