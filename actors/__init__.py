"""The protocol messages and the Engine, Worker and Transfer actors."""
