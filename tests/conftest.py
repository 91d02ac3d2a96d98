# Triton picks interpreter vs compiler when a kernel is decorated, so the switch must be set before any test module
# imports triton or the kernels. `make test-gpu` (MORPHLING_GPU_TESTS=1) compiles them for the GPU instead.
import os
if os.environ.get("MORPHLING_GPU_TESTS") != "1":
    os.environ["TRITON_INTERPRET"] = "1"


def _interpreter_loop_bounds() -> None:
    """Let the interpreter of triton < 3.7 take a loop bound computed in the kernel (`range(0, n_blocks)`).

    Its scalars are 1-element arrays, and it turns one into a bound with int(array), which numpy 2 refuses
    ("only 0-dimensional arrays can be converted to Python scalars"); triton 3.7 squeezes first. GPU images
    ship triton 3.6 (torch 2.11 pins it) and the requirements admit 3.2 on: do what 3.7 does.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: the kernel tests skip
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, *scope):  # 3.6 passes the patch's scope; earlier ones set attributes directly
        original(tensor, *scope)

        def index(self):
            return int(self.handle.data.squeeze())

        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:
            tensor.__index__ = index

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


_interpreter_loop_bounds()
