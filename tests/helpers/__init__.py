"""Test helpers shared by the distributed tests."""
