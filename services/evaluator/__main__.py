import sys

from policyloop.services.evaluator.service import main

sys.exit(main(sys.argv[1:]))
