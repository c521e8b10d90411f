"""Put before ../shared/tools/deepseek-v4-cpu on PYTHONPATH (DSV4_SHIM_DIR names that folder).

The shared shim registers Python stand-ins for the DeepSeek-V4 kernels that the AVX2 build of
vLLM lacks. On an AVX-512 host vLLM would load its AVX-512 build, which defines the same operators
again (torch aborts on the duplicate), and whose real kernels need AMX. So vLLM is pointed at the
AVX2 build the shim was written for; then the shim runs unchanged.
"""

import os

if os.environ.get("DSV4_SHIM") == "1":
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    shim = os.path.join(os.environ["DSV4_SHIM_DIR"], "sitecustomize.py")
    with open(shim) as f:
        exec(compile(f.read(), shim, "exec"))
