"""A stateful environment written as a team would write one: a bookkeeping desk.

The customer asks for a sum; the assistant may use the desk's calculator, which books every
calculation in the desk's ledger (the state). The episode ends with the assistant's reply. Reward:
1 for a reply that states the right total, 0.2 for a calculation booked with the right expression,
and -0.5 for booking the same calculation twice (a double entry). Standard library only: it runs
in a sandbox session with no network and nothing of policyloop.
"""

import random
import re

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression such as '12 + 7' and return the result.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "The expression to evaluate."}}, "required": ["expression"]}}}
EXPRESSION = re.compile(r"\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*")


class TallyDesk:
    tools = [CALCULATOR]

    def reset(self, task):
        seed = int(task["metadata"].get("seed", "0"))
        rng = random.Random(seed)
        self.a, self.b, self.op = rng.randrange(1, 50), rng.randrange(1, 50), rng.choice("+-")
        self.total = self.a + self.b if self.op == "+" else self.a - self.b
        self.ledger = []  # every calculation booked this episode
        return f"What is {self.a} {self.op} {self.b}?"

    def step(self, action):
        if action.tool_calls:
            results, reward = [], 0.0
            for call in action.tool_calls:
                if call.name != "calculator":
                    results.append(f"error: no tool {call.name!r}")
                    continue
                expression = str(call.arguments.get("expression", ""))
                match = EXPRESSION.fullmatch(expression)
                if match is None:
                    results.append("error: give an expression like '12 + 7'")
                    continue
                a, op, b = int(match[1]), match[2], int(match[3])
                if (a, op, b) in self.ledger:
                    reward -= 0.5  # a double entry
                elif (a, op, b) == (self.a, self.op, self.b):
                    reward += 0.2
                self.ledger.append((a, op, b))
                results.append(str(a + b if op == "+" else a - b))
            return [{"role": "tool", "content": r} for r in results], reward, False
        numbers = re.findall(r"-?\d+", action.content)
        right = not action.truncated and bool(numbers) and int(numbers[-1]) == self.total
        return None, 1.0 if right else 0.0, True
