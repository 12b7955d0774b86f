"""What travels between the run's processes: micro-batches from the orchestrator to each trainer
rank (the transports), the run contract both ends check (`contract`), and weights from trainer
rank 0 to the inference workers in memory (`weight_transfer`).

`endpoints.make_sender` / `endpoints.make_receiver` build the configured transport for one trainer
rank; `base` holds what every transport is and raises, `config` its settings, `messages` what
travels. This package runs no code of its own, so that a config importing `transport.config`
(or `transport.contract`) loads neither zmq nor numpy (tests/unit/config_test.py checks it).
"""
