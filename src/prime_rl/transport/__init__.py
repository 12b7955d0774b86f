"""Transports: how micro-batches get from the orchestrator to each trainer rank.

`endpoints.make_sender` / `endpoints.make_receiver` build the configured transport for one trainer
rank; `base` holds what every transport is and raises, `config` its settings, `messages` what
travels. This package runs no code of its own, so that a config importing `transport.config`
loads neither zmq nor numpy (tests/unit/config_test.py checks it).
"""
