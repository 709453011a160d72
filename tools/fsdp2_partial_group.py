"""torchtitan 0.3.0's chunked loss on torch's FSDP2, without torchtitan: does this torch complete a
``fully_shard([norm, head])`` group whose forward ran only ``norm``?

    torchrun --standalone --nproc-per-node 1 tools/fsdp2_partial_group.py

torchtitan 0.3.0 shards ``[model.norm, model.lm_head]`` as one unit (reshard_after_forward
False); its ``ChunkedLossWrapper`` runs the model without ``lm_head``, calls ``lm_head`` itself on
8 detached chunks (``unshard`` first, ``reshard`` after the loop), then backpropagates the
accumulated gradient through the decoder. This does the same on a block, a norm and a head,
once with the grouped unit and once with one unit per module (the example's shim 10), on CUDA
if there is one (NCCL), else the CPU (gloo), and prints each outcome. torch 2.13 completes the
group from the root's post-forward; 2.11 registers no pre-backward hook on the norm's output,
so the norm's backward finds its weight freed by ``head.reshard()``. Seen: torch 2.11.0+cu130
on an H100, the grouped unit fails with "The tensor has a non-zero number of elements, but its
data is not allocated yet" and one unit per module trains; torch 2.13 on CPU, both train. (On
CPU a missing hook is reported before the backward: a CPU kernel would read a null pointer.)
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class Model(nn.Module):
    def __init__(self, dim: int = 32, vocab: int = 64) -> None:
        super().__init__()
        self.block = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # without the head, as torchtitan's
        return self.norm(self.block(x))


def step(model: Model, device: torch.device, chunks: int = 4) -> float:
    """One step the way ChunkedLossWrapper takes it; returns the loss."""
    x = torch.randn(2, 8, 32, device=device)
    labels = torch.randint(0, 64, (2, 8), device=device)
    hidden = model(x)
    head = model.head
    head.set_reshard_after_forward(False)
    head.set_reshard_after_backward(False)
    head.unshard()
    grads, total = [], 0.0
    for h, y in zip(hidden.detach().chunk(chunks, dim=1), labels.chunk(chunks, dim=1)):
        h.requires_grad_(True)
        loss = nn.functional.cross_entropy(head(h).flatten(0, 1), y.flatten()) / chunks
        loss.backward()
        grads.append(h.grad)
        total += loss.item()
    head.set_reshard_after_forward(True)
    head.set_reshard_after_backward(True)
    head.reshard()
    if not has_pre_backward_hook(hidden, model.norm):
        message = "no pre-backward hook of the norm's unit on its output: its backward reads a freed weight"
        if hidden.device.type == "cpu":  # a CPU kernel reads the null data pointer: a segfault
            raise RuntimeError(message)
        print(message, flush=True)
    hidden.backward(torch.cat(grads, dim=1))
    return total


def has_pre_backward_hook(output: torch.Tensor, module: nn.Module) -> bool:
    """Whether ``module``'s FSDP state hooked ``output`` to gather its parameters in backward."""
    state = module._get_fsdp_state()
    return any(getattr(hook, "__self__", None) is state for hook in (output._backward_hooks or {}).values())


def main() -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    print(f"torch {torch.__version__} on {device.type}", flush=True)
    for grouped in (True, False):
        torch.manual_seed(0)
        model = Model().to(device)
        fully_shard(model.block)
        if grouped:
            fully_shard([model.norm, model.head], reshard_after_forward=False)
        else:
            fully_shard(model.norm, reshard_after_forward=False)
            fully_shard(model.head, reshard_after_forward=False)
        fully_shard(model)
        name = "fully_shard([norm, head])" if grouped else "fully_shard(norm); fully_shard(head)"
        try:
            losses = [step(model, device) for _ in range(2)]
            print(f"{name}: ok, losses {losses[0]:.6f} {losses[1]:.6f}", flush=True)
        except RuntimeError as e:
            print(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
