"""The sandbox providers' HTTP APIs: the same contracts the adapters speak to real providers."""
