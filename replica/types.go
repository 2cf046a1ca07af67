package replica

// Sizes of the store's units; see the package documentation.
const (
	// BlockSize is the unit of volume sizes and of a layer's block index.
	BlockSize = 4096
	// SectorSize is the alignment of I/O offsets and lengths.
	SectorSize = 512
	// MaxIO is the most bytes one request may carry.
	MaxIO = 8 << 20
)

// Op is what every data request carries: the caller's epoch (for fencing),
// the replica-set generation its write is made under (for the write
// history), and whether the request must be durable before it returns.
type Op struct {
	Epoch      uint64
	Generation uint64
	FUA        bool
}

// Extent is a byte range of a volume.
type Extent struct {
	Off int64
	Len int64
}
