"""Scale-out on Dask distributed (optional extra ``bakron[dask]``)."""
