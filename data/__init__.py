"""Data for shardlm: tokenizers, preprocessing to memory-mapped token files, blocks, batches.

Submodules are imported where they are used (``from data.token_block import
TokenBlockDataset``) so that, e.g., ``train --help`` never pays for torch or ``datasets``.
This package never imports ``trainer`` or ``torch.distributed``.
"""
