import sys

from policyloop.services.sandbox.service import main

sys.exit(main(sys.argv[1:]))
