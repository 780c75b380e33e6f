"""The stack harness the tests and the benchmarks share (``tests/`` and ``bench/`` import it; no
service does).

    ports.py          free_port / free_port_block: the one port allocator (never a port twice)
    processes.py      start a service process, wait for it with a deadline, fail with its log's tail
    kafka/            RecordWriter, StreamAssembler (Kafka from the outside)
    worker.py         ``chatpipe inference`` processes, requests, and a Reader of all they write
    streams.py        ``chatpipe streams`` as a process (StreamsWorker), Tap (read topics from the start)
    gateway.py        ``chatpipe gateway`` processes and the whole pipeline (streams + worker + gateway)
    qdrant.py         real Qdrant server processes (../shared/tools/qdrant): a peer, alone or of a cluster
    redis.py          a real redis-server (the stack's command line) on a free port: stop, kill, start again
    lora_adapters.py  peft LoRA adapters with random factors, and peft's merge of one (the reference)
    synthetic_log.py  a deterministic synthetic conversation log (Spark tests, bench/finetune.py)

This is the top layer's (``chatpipe``) so that it may start every tier; it is not a product module:
nothing outside tests/, bench/ and this package imports it (tests/static/test_scripts_import_no_tests.py).
"""
