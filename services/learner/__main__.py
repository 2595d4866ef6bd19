import sys

from policyloop.services.learner.service import main

sys.exit(main(sys.argv[1:]))
