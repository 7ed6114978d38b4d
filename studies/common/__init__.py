"""What several studies share: the mixed and long workloads of Table 1, the quality measures,
the work meter and plotting."""
