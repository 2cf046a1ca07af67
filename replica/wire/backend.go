package wire

import "github.com/stor-io/stor/replica"

// Replica is what the server needs of a replica: the methods of
// *replica.Replica. Every method is called concurrently with the others.
type Replica interface {
	ID() string
	Size() uint64
	Epoch() uint64
	Fence(epoch uint64) error
	ReadAt(o replica.Op, p []byte, off int64) error
	WriteAt(o replica.Op, p []byte, off int64) error
	WriteZeroes(o replica.Op, off, n int64) error
	Trim(o replica.Op, off, n int64) error
	Flush(o replica.Op) error
	Grow(o replica.Op, size uint64) error
	CreateSnapshot(o replica.Op, id string) error
	DeleteSnapshot(o replica.Op, id string) error
	ReadSnapshotAt(o replica.Op, id string, p []byte, off int64) error
	Extents(o replica.Op, snapshotID string, from int64, limit int) ([]replica.Extent, error)
	DirtyRegions(o replica.Op) ([]replica.Extent, error)
	WrittenSince(o replica.Op, generation uint64) ([]replica.Extent, error)
	BeginRebuild(o replica.Op) error
	RebuildWrite(o replica.Op, p []byte, off int64) error
	EndRebuild(o replica.Op) error
}

// Backend finds the replicas a server serves. A replica that does not
// exist is an error wrapping replica.ErrNotFound.
type Backend interface {
	Replica(id string) (Replica, error)
}

// BackendFunc adapts a function to Backend. For a store whose Get returns
// *replica.Replica, convert explicitly so that a nil pointer never becomes
// a non-nil interface:
//
//	wire.BackendFunc(func(id string) (wire.Replica, error) {
//		r, err := store.Get(id)
//		if err != nil {
//			return nil, err
//		}
//		return r, nil
//	})
type BackendFunc func(id string) (Replica, error)

// Replica calls f.
func (f BackendFunc) Replica(id string) (Replica, error) { return f(id) }
