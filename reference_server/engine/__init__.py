"""The reference server's engine: the step loop (``engine``), requests (``sequence``), the scheduling rule
(``scheduler``) with its policies (``policies``) and batching gate (``batching``), paged KV bookkeeping
(``block_manager``), a step's record (``iteration``) and the process's CPU memory settings (``cpu_memory``)."""
