"""epid: synthetic VMAT deliveries, EPID frames and cross-trained forward/inverse models."""

import os

# OpenMP threads that spin while waiting make torch and LAPACK calls many times slower
# whenever another process shares the cores (DataLoader workers, a second rank, a
# neighbour's job). Passive waiting costs little on an idle machine. It only takes
# effect if set before torch starts its thread pool; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
