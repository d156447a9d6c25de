"""Offload core: one OffloadScheduler per engine, one OffloadWorker per rank; knows no host."""
