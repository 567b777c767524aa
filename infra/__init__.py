"""The platform: settings, Kafka clients, the object store, bootstrap, the local server launcher."""
