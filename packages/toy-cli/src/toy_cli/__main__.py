import sys

from toy_cli.main import main

sys.exit(main())
