import sys

from hvd_train.cli import main

sys.exit(main())
