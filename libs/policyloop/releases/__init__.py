"""Which versions of a run are good and which one is served: evaluation results by run and
version (`evals`, in Redis and on EVALS), the regression rule (`verdict`), and promotions and
rollbacks (`promotion`, a per-run log on PROMOTIONS that serving replicas follow). Shared by the
evaluator (it writes results and promotes by rule) and the gateway (GetRun, PromoteVersion,
RollbackVersion, ListVersions)."""
