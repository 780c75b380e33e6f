"""Local stack (the real Kafka broker from Maven Central jars) and deployment manifests.

Only the CLI's stack commands and the test fixtures import this package.
"""
