"""The contract between the worker and its ranks, in one home below both.

`plan`: what a builder returns (Plan, BuildContext); `data`: the datasets the engine reads (TokenFile,
Shards, Stream, data_path); `env`: the environment variables the worker sets for the ranks. The
engine, the worker and the SDK (`dptrain`, whose `dptrain.plan` and `dptrain.data` re-export these
under the names users write) all import this package; it imports none of them.

Importing the package or `rank_contract.env` is cheap and torch-free (the light client imports
`dptrain`, which reads `env`); `plan` and `data` import torch.
"""
