package replica

// Sizes of the store's units; see the package documentation.
const (
	// BlockSize is the unit of volume sizes and of a layer's block index.
	BlockSize = 4096
	// SectorSize is the alignment of I/O offsets and lengths.
	SectorSize = 512
	// MaxIO is the most bytes one request may carry.
	MaxIO = 8 << 20
	// MaxZeroes is the most bytes one WriteZeroes or Trim may name. They
	// carry no payload, but each marks its range in the dirty-region log,
	// the write history and the head's index: a cap keeps what one
	// request costs a server bounded whatever the peer sends. (NBD's
	// 32-bit lengths name up to 4 GiB; the engine splits them.)
	MaxZeroes = 1 << 30
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
