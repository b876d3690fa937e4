"""hybridserve.cache"""
