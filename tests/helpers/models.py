"""Small LightningModules and data shared by the Trainer-level tests."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, Dataset


class IndexedRegression(Dataset):
    """``(x, y, index)`` samples from a fixed seed, so every process sees the same data set."""

    def __init__(self, n: int = 64, dim: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g, dtype=dtype)
        self.y = torch.randn(n, 1, generator=g, dtype=dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], torch.tensor(i)


class DenseRegressor(LightningModule):
    """A dense two-layer MLP; records which sample indices each rank trained on."""

    def __init__(self, dim: int = 8, lr: float = 0.1, batch_size: int = 4, dtype: torch.dtype = torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
        self.lr, self.batch_size, self.dtype_ = lr, batch_size, dtype
        self.seen: list[int] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen.extend(idx.tolist())
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        return DataLoader(IndexedRegression(dtype=self.dtype_), batch_size=self.batch_size, shuffle=False)
