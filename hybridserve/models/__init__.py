"""hybridserve.models"""
