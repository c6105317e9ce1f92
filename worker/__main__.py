import sys

from vramledger.worker.cli import main

sys.exit(main())
