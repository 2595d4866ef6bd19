import sys

from policyloop.services.tinker.service import main

sys.exit(main(sys.argv[1:]))
