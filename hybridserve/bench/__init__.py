"""hybridserve.bench"""
