import sys

from dpfl_tf.cli import main

sys.exit(main())
