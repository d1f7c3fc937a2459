"""Registers ``capsense-masked`` with lm-eval releases that have no plugin discovery.

Imported at every Python start-up by ``capsense_lm_eval.pth``, so it must stay tiny: it
imports neither torch nor lm-eval. It puts a finder on ``sys.meta_path`` that waits for
``lm_eval.models`` (where lm-eval fills its model registry) and, right after that module
runs, registers ``capsense-masked`` as a lazy ``"module:Class"`` placeholder. Nothing is
imported from capsense until lm-eval actually asks for the model.
"""

import sys

MODEL_NAME = "capsense-masked"
TARGET = "capsense.evaluation.lm_eval_model:CapsenseMaskedLM"


def register() -> None:
    try:
        from lm_eval.api.registry import model_registry
    except ImportError:  # an lm-eval without the lazy Registry: import the class itself
        import capsense.evaluation.lm_eval_model  # noqa: F401  (registers via @register_model)

        return
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)


class _LmEvalModelsFinder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "lm_eval.models":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                register()
            except Exception as e:  # never break lm-eval's own import
                print(f"capsense: could not register {MODEL_NAME!r} with lm-eval: {e}", file=sys.stderr)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if "lm_eval.models" in sys.modules:
        register()
    elif not any(isinstance(f, _LmEvalModelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LmEvalModelsFinder())


install()
