"""`dflash-generate`: the target answers the training conversations again, writing JSONL shards that
dflash-precompute reads.

    cli.py          the command line -> GenerateConfig
    config.py       GenerateConfig, the `[generate.*]` tables
    job.py          run(cfg): settings, plan, the sort windows answered round by round, shards,
                    manifest
    chats.py        input record -> the turns to generate -> output record
    decode.py       the decoders: transformers (batched, static KV cache) and vLLM
    attention.py    the decode steps' attention (packed GQA sdpa) and when a 4D mask is right
    cuda_graph.py   a decode step replayed as a CUDA graph

Nothing is imported here, so `dflash-generate --help` stays fast.
"""
