"""llama.cpp (llama-cpp-python 0.3.36) loaded the way this repository's scripts need it: the
golden fixtures (scripts/golden/make_golden.py) and the engine comparison
(scripts/bench/llamacpp_engine.py)."""

import llama_cpp
import llama_cpp.llama_cpp as llama_capi


def load(path, **kwargs):
    """`llama_cpp.Llama(model_path=path, **kwargs)` on plain CPU buffers.

    llama-cpp-python 0.3.36 has no keyword for llama_model_params.use_extra_bufts. With extra
    buffer types enabled, llama.cpp repacks Q4_1 weights for its AMX kernels on CPUs that
    report AMX, and that path crashes (SIGSEGV) on this machine; on other CPUs the flag changes
    nothing. So the default-params function that Llama.__init__ calls is wrapped for the load.
    """
    orig = llama_capi.llama_model_default_params

    def no_extra_bufts():
        p = orig()
        p.use_extra_bufts = False
        return p

    llama_capi.llama_model_default_params = no_extra_bufts
    try:
        return llama_cpp.Llama(model_path=path, **kwargs)
    finally:
        llama_capi.llama_model_default_params = orig
