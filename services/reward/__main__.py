import sys

from policyloop.services.reward.service import main

sys.exit(main(sys.argv[1:]))
