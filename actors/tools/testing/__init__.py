"""What the tests run against, never imported by the product: the in-process runner (the
plain-loop reference), the sequential oracle and random programs, the protocol harness, the
demo pipeline (the runtime's own workload), the shared-memory builders and leak checks
(``shm``), the storage helpers (``storage``) and a throwaway redis-server (``redis_server``)."""
