"""Methods added to vLLM's workers (`--worker-extension-cls`), called through `collective_rpc`.

Only what the reload route needs. Invariant: after `prime_rl_reload(path)` the model computes with
the weights in `path`, tied embeddings included (the CPU backend keeps a pre-packed copy of a tied
lm_head that must be rebuilt after an in-place reload).
"""

from __future__ import annotations


class WeightReloadExtension:
    def prime_rl_reload(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        config = getattr(model, "config", None)
        lm_head = getattr(model, "lm_head", None)
        if getattr(config, "tie_word_embeddings", False) and lm_head is not None:
            method = getattr(lm_head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(lm_head)
