"""OFT's modules beside the VLA, under the parameter names of its ``.pt`` files
(``prismatic/models/action_heads.py``, ``prismatic/models/projectors.py``).

``L1RegressionActionHead``: ``model`` is an ``MLPResNet`` over the A last hidden states of one
action concatenated (input D·A, width D, output A):

    x = fc1(LN1(h)) → ReLU → for each block: x + ReLU(Linear(LN(x))) → fc2(LN2(x))

(``mlp_resnet_blocks.N.ffn`` = [LayerNorm, Linear, ReLU], LayerNorm eps 1e-5, torch's default).

``ProprioProjector``: state → one language-model embedding, ``fc2(GELU(fc1(p)))``.
"""

from __future__ import annotations

from torch import Tensor, nn


class MLPResNetBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ffn = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.ReLU())

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ffn(x)


class MLPResNet(nn.Module):
    def __init__(self, num_blocks: int, input_dim: int, hidden_dim: int, output_dim: int):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(input_dim)
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.relu = nn.ReLU()
        self.mlp_resnet_blocks = nn.ModuleList([MLPResNetBlock(hidden_dim) for _ in range(num_blocks)])
        self.layer_norm2 = nn.LayerNorm(hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.fc1(self.layer_norm1(x)))
        for block in self.mlp_resnet_blocks:
            x = block(x)
        return self.fc2(self.layer_norm2(x))


class L1RegressionActionHead(nn.Module):
    """Hidden states [B, K·A, D] of a chunk's action positions → normalized actions [B, K, A]."""

    def __init__(self, input_dim: int, hidden_dim: int, action_dim: int, num_blocks: int = 2):
        super().__init__()
        self.action_dim = action_dim
        self.model = MLPResNet(num_blocks, input_dim, hidden_dim, action_dim)

    @classmethod
    def from_state(cls, state: dict[str, Tensor]) -> "L1RegressionActionHead":
        """The head whose sizes ``state`` (a loaded ``action_head`` file) shows."""
        hidden, input_dim = state["model.fc1.weight"].shape
        blocks = 1 + max([int(k.split(".")[2]) for k in state if k.startswith("model.mlp_resnet_blocks.")] or [-1])
        return cls(input_dim, hidden, state["model.fc2.weight"].shape[0], blocks)

    def forward(self, hidden: Tensor, chunk: int) -> Tensor:
        return self.model(hidden.reshape(hidden.shape[0], chunk, -1))


class ProprioProjector(nn.Module):
    def __init__(self, llm_dim: int, proprio_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(proprio_dim, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)
        self.act_fn1 = nn.GELU()

    def forward(self, proprio: Tensor) -> Tensor:
        return self.fc2(self.act_fn1(self.fc1(proprio)))
