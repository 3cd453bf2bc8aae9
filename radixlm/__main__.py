import sys

from radixlm.cli import main

sys.exit(main())
