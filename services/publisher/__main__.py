import sys

from policyloop.services.publisher.service import main

sys.exit(main(sys.argv[1:]))
