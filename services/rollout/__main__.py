import sys

from policyloop.services.rollout.service import main

sys.exit(main(sys.argv[1:]))
