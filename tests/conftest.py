# Triton picks interpreter vs compiler when a kernel is decorated, so the switch must be set before any test module imports triton or the kernels.
import os; os.environ["TRITON_INTERPRET"] = "1"
