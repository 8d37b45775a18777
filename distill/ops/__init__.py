"""How a run behaves as a process among others: the rank-aware error banner and exit codes
(`errors`), process groups and collectives (`distributed`), the device mesh a sharded teacher
lives on (`mesh`), the stall watchdog (`watchdog`), the DataLoader's worker processes
(`workers`), injected faults for rehearsing failures (`faults`),
the python-vs-torchrun launch check (`launch_check`), the output folder's lock (`output_dir`),
every command's path flags checked before any work (`paths`) and crash-safe file writing (`files`). The bottom layer: it imports nothing else from distill, and
knows nothing of models, prompts or methods.
"""
