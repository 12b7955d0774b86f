"""Methods added to vLLM's workers (`--worker-extension-cls`), called through `collective_rpc`.

Only what the weight routes need. Invariant: after `prime_rl_reload(path)` or a completed
`prime_rl_receive(...)`, the model computes with the new weights, tied embeddings and MoE experts
included. The CPU backend keeps both in a pre-packed form that vLLM's in-place reload does not
rebuild (a tied lm_head's copy; the experts' grouped-GEMM layout, which vLLM 0.32 packs only on
the first load), so they are packed again here.
"""

from __future__ import annotations

from pathlib import Path

from prime_rl.engine.policy_logprobs import install_if_asked

# vLLM imports this class in every process that runs the model, before its first sampling step.
install_if_asked()

CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt")


def checkpoint_bytes(model: str) -> int:
    """The bytes of the weight files in the model folder `model` (0 for a hub id or no folder)."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in CHECKPOINT_SUFFIXES and f.is_file())


class WeightReloadExtension:
    def prime_rl_weight_bytes(self) -> int:
        """The bytes of this worker's weights (bounds what a broadcast may send it): its parameters,
        or the checkpoint it was started from where that is more. vLLM's CPU backend repacks the
        linear layers' weights out of their parameters (left with shape [0]), so on CPU the
        parameters alone undercount a 54M-parameter model 80-fold, and a trainer's broadcast of it
        was refused as too big."""
        model = self.model_runner.get_model()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        return max(params, checkpoint_bytes(str(self.model_runner.model_config.model)))

    def prime_rl_reload(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        self._prime_rl_after_reload()

    def prime_rl_receive(
        self,
        host: str,
        port: int,
        prefix: str,
        first_rank: int,
        world_size: int,
        plan: list,
        timeout_s: float,
        sealed: bool = False,
    ) -> None:
        """Join the trainer's broadcast group for one update (as `first_rank` + this worker's rank in
        its server) and load every tensor as it arrives."""
        import torch

        from prime_rl.auth.store import RemoteStore
        from prime_rl.transport.weight_transfer import join_group, plan_from_json, receive, seal_key

        device = self.device if getattr(self, "device", None) is not None else torch.device("cpu")
        cuda = torch.device(device).type == "cuda"
        store = RemoteStore(host, port, timeout_s)  # proves itself the run's before anything joins
        group = join_group(
            store, prefix, first_rank + int(getattr(self, "rank", 0)), world_size, timeout_s, cuda
        )
        key = seal_key(prefix) if sealed and not cuda else None
        stream = receive(group, plan_from_json(plan), device, key)
        self.reload_weights(weights_iterator=stream)
        for _ in stream:  # take every chunk even if the loader skipped the last names: rank 0 waits on us
            pass
        self._prime_rl_after_reload()  # the group is dropped on return

    def _prime_rl_after_reload(self) -> None:
        model = self.model_runner.get_model()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
            # vLLM's reload skips this step for a kernel already built (it assumes the weights need
            # no repacking); the CPU experts then read unpacked weights as packed ones.
            if experts is not None and type(experts).__module__.endswith("cpu_moe"):
                experts.process_weights_after_loading(module)
        config = getattr(model, "config", None)
        lm_head = getattr(model, "lm_head", None)
        if getattr(config, "tie_word_embeddings", False) and lm_head is not None:
            method = getattr(lm_head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(lm_head)
