"""Files that cross nodes: model folders packed into Ray's object store and materialized in a node-local cache."""
