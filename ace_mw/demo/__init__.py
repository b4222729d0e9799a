"""`ace-mw demo`: the closed loop on a real workload, end to end.

The one package that uses every layer at once: the core's config and adapters, the ASGI middleware
in front of each policy, and an engine behind it (the in-process engine, your own engine, or real
llama.cpp servers). Nothing below it imports it. Its modules import what they need themselves, so
that `ace-mw --help` and the torch-free parts (the workload, the report) load without torch.
"""
