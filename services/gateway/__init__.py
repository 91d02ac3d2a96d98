"""The HTTP gateway: OpenAI API in front of the executors, over the bus."""
