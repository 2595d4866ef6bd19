from policyloop.cli import app

app(prog_name="policyloop")
