import sys

from policyloop.services.gateway.service import main

sys.exit(main(sys.argv[1:]))
