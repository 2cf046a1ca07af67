package raftstore

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"

	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

var (
	bucketMeta          = []byte("meta")
	bucketServers       = []byte("servers")
	bucketVolumes       = []byte("volumes")
	bucketVolumeNames   = []byte("volume_names")
	bucketSnapshots     = []byte("snapshots")
	bucketSnapshotNames = []byte("snapshot_names")
	bucketNodes         = []byte("nodes")

	// requiredBuckets must be in every state image; the buckets added
	// later (nodes) are created when a file or snapshot from before them
	// is opened.
	requiredBuckets = [][]byte{bucketMeta, bucketServers, bucketVolumes, bucketVolumeNames, bucketSnapshots, bucketSnapshotNames}
	allBuckets      = append(slices.Clone(requiredBuckets), bucketNodes, bucketEvents)

	keyAppliedIndex = []byte("applied_index")
	keyClusterID    = []byte("cluster_id")
)

// Reader reads FSM state inside one bbolt transaction: everything it
// returns is one consistent view. Messages it returns are the caller's.
type Reader struct {
	tx *bolt.Tx
}

// AppliedIndex is the index of the last log entry reflected in this view.
func (r *Reader) AppliedIndex() uint64 {
	v := r.tx.Bucket(bucketMeta).Get(keyAppliedIndex)
	if len(v) != 8 {
		return 0
	}
	return binary.BigEndian.Uint64(v)
}

// ClusterID is the id chosen when the cluster was bootstrapped, or "".
func (r *Reader) ClusterID() string {
	return string(r.tx.Bucket(bucketMeta).Get(keyClusterID))
}

// Server returns the server with the given id, or ErrNotFound.
func (r *Reader) Server(id string) (*storpb.Server, error) {
	s := &storpb.Server{}
	if err := r.get(bucketServers, id, s); err != nil {
		return nil, fmt.Errorf("server %q: %w", id, err)
	}
	return s, nil
}

// Servers returns every registered server, ordered by id.
func (r *Reader) Servers() ([]*storpb.Server, error) {
	var out []*storpb.Server
	err := r.tx.Bucket(bucketServers).ForEach(func(k, v []byte) error {
		s := &storpb.Server{}
		if err := proto.Unmarshal(v, s); err != nil {
			return fmt.Errorf("%w: server %q: %v", ErrCorrupt, k, err)
		}
		out = append(out, s)
		return nil
	})
	return out, err
}

// Volume returns the volume with the given id, or ErrNotFound; a deleted
// volume kept for its snapshots is returned (state DELETED).
func (r *Reader) Volume(id string) (*storpb.Volume, error) {
	v := &storpb.Volume{}
	if err := r.get(bucketVolumes, id, v); err != nil {
		return nil, fmt.Errorf("volume %q: %w", id, err)
	}
	return v, nil
}

// VolumeByName returns the volume with the given name, or ErrNotFound. A
// deleted volume kept for its snapshots has no name any more (Volume finds
// it by id).
func (r *Reader) VolumeByName(name string) (*storpb.Volume, error) {
	id := r.tx.Bucket(bucketVolumeNames).Get([]byte(name))
	if id == nil {
		return nil, fmt.Errorf("volume %q: %w", name, ErrNotFound)
	}
	return r.Volume(string(id))
}

// VolumeByRef resolves a reference by id or by name; exactly one must be set.
func (r *Reader) VolumeByRef(ref *storpb.VolumeRef) (*storpb.Volume, error) {
	switch {
	case ref == nil || (ref.Id == "") == (ref.Name == ""):
		return nil, fmt.Errorf("%w: name a volume by exactly one of id or name", ErrInvalidArgument)
	case len(ref.Id) > maxNameLen || len(ref.Name) > maxNameLen:
		return nil, fmt.Errorf("%w: volume %s: longer than %d bytes", ErrInvalidArgument, QuoteID(ref.Id+ref.Name), maxNameLen)
	case ref.Id != "":
		return r.Volume(ref.Id)
	default:
		return r.VolumeByName(ref.Name)
	}
}

// Volumes returns up to limit volumes (0: all) in id order, starting after
// the position encoded in token, and the token for the next page ("" on the
// last page). A token that was not returned by Volumes is ErrInvalidArgument.
// It includes the deleted volumes kept for their snapshots (state DELETED),
// which the servers keep and repair like any other.
func (r *Reader) Volumes(token string, limit int) ([]*storpb.Volume, string, error) {
	return r.ListVolumes(Page{Token: token, Limit: limit}, true)
}

// Page bounds one page of a listing.
type Page struct {
	// Token is the position to continue after: "" for the first page,
	// else the token the previous page returned.
	Token string
	// Limit is the most entries the page holds; 0: no limit.
	Limit int
	// MaxBytes stops the page before an entry that would take its entries'
	// encoded size past it (a page holds at least one entry, whatever its
	// size); 0: no limit.
	MaxBytes int
}

// ListVolumes is Volumes as users list them: the deleted volumes kept for
// their snapshots only if includeDeleted.
func (r *Reader) ListVolumes(p Page, includeDeleted bool) ([]*storpb.Volume, string, error) {
	var out []*storpb.Volume
	next, err := r.page(bucketVolumes, p, func(v []byte) (func(), error) {
		vol := &storpb.Volume{}
		if err := proto.Unmarshal(v, vol); err != nil {
			return nil, fmt.Errorf("%w: volume: %v", ErrCorrupt, err)
		}
		if IsDeleted(vol) && !includeDeleted {
			return nil, nil
		}
		return func() { out = append(out, vol) }, nil
	})
	return out, next, err
}

// Snapshot returns the snapshot with the given id, or ErrNotFound.
func (r *Reader) Snapshot(id string) (*storpb.Snapshot, error) {
	s := &storpb.Snapshot{}
	if err := r.get(bucketSnapshots, id, s); err != nil {
		return nil, fmt.Errorf("snapshot %q: %w", id, err)
	}
	return s, nil
}

// SnapshotByRef resolves a reference by id or by name.
func (r *Reader) SnapshotByRef(ref *storpb.SnapshotRef) (*storpb.Snapshot, error) {
	switch {
	case ref == nil || (ref.Id == "") == (ref.Name == ""):
		return nil, fmt.Errorf("%w: name a snapshot by exactly one of id or name", ErrInvalidArgument)
	case len(ref.Id) > maxNameLen || len(ref.Name) > maxNameLen:
		return nil, fmt.Errorf("%w: snapshot %s: longer than %d bytes", ErrInvalidArgument, QuoteID(ref.Id+ref.Name), maxNameLen)
	case ref.Id != "":
		return r.Snapshot(ref.Id)
	}
	id := r.tx.Bucket(bucketSnapshotNames).Get([]byte(ref.Name))
	if id == nil {
		return nil, fmt.Errorf("snapshot %q: %w", ref.Name, ErrNotFound)
	}
	return r.Snapshot(string(id))
}

// Snapshots pages through snapshots in id order like Volumes; volumeID, if
// set, keeps only that volume's snapshots.
func (r *Reader) Snapshots(volumeID, token string, limit int) ([]*storpb.Snapshot, string, error) {
	return r.ListSnapshots(volumeID, Page{Token: token, Limit: limit})
}

// ListSnapshots is Snapshots bounded by a Page.
func (r *Reader) ListSnapshots(volumeID string, p Page) ([]*storpb.Snapshot, string, error) {
	var out []*storpb.Snapshot
	next, err := r.page(bucketSnapshots, p, func(v []byte) (func(), error) {
		s := &storpb.Snapshot{}
		if err := proto.Unmarshal(v, s); err != nil {
			return nil, fmt.Errorf("%w: snapshot: %v", ErrCorrupt, err)
		}
		if volumeID != "" && s.VolumeId != volumeID {
			return nil, nil
		}
		return func() { out = append(out, s) }, nil
	})
	return out, next, err
}

// snapshotCount counts the snapshots of one volume.
func (r *Reader) snapshotCount(volumeID string) (int, error) {
	s, _, err := r.Snapshots(volumeID, "", 0)
	return len(s), err
}

const pageTokenPrefix = "v1:"

func encodePageToken(lastKey []byte) string {
	return base64.RawURLEncoding.EncodeToString(append([]byte(pageTokenPrefix), lastKey...))
}

func decodePageToken(token string) ([]byte, error) {
	b, err := base64.RawURLEncoding.DecodeString(token)
	if err != nil || !strings.HasPrefix(string(b), pageTokenPrefix) || len(b) == len(pageTokenPrefix) {
		return nil, fmt.Errorf("%w: page token %q was not issued by this cluster", ErrInvalidArgument, token)
	}
	return b[len(pageTokenPrefix):], nil
}

// page walks bucket in key order after p.Token's key. match decides an
// entry: nil to skip it, else the function that takes it into the page
// (called only if it fits p's bounds).
func (r *Reader) page(bucket []byte, p Page, match func(v []byte) (func(), error)) (string, error) {
	c := r.tx.Bucket(bucket).Cursor()
	k, v := c.First()
	if p.Token != "" {
		after, err := decodePageToken(p.Token)
		if err != nil {
			return "", err
		}
		k, v = c.Seek(after)
		if k != nil && bytes.Equal(k, after) {
			k, v = c.Next()
		}
	}
	n, size := 0, 0
	var last []byte // the last key taken or skipped
	for ; k != nil; k, v = c.Next() {
		if p.Limit > 0 && n == p.Limit {
			return encodePageToken(last), nil
		}
		take, err := match(v)
		if err != nil {
			return "", err
		}
		if take != nil {
			if n > 0 && p.MaxBytes > 0 && size+len(v) > p.MaxBytes {
				return encodePageToken(last), nil
			}
			take()
			n++
			size += len(v)
		}
		last = append(last[:0], k...)
	}
	return "", nil
}

func (r *Reader) get(bucket []byte, key string, m proto.Message) error {
	v := r.tx.Bucket(bucket).Get([]byte(key))
	if v == nil {
		return ErrNotFound
	}
	if err := proto.Unmarshal(v, m); err != nil {
		return fmt.Errorf("%w: %s/%s: %v", ErrCorrupt, bucket, key, err)
	}
	return nil
}

// writer adds writes to a Reader; only the FSM holds one.
type writer struct {
	Reader
	// The command being applied, for the events its writes record
	// (events.go): its op, time, and for a replica state change its
	// reason.
	op     op
	at     int64
	reason string
	// lastTouched lists volumes changed as a side effect of the command
	// being applied (a removed server's replicas), for watchers.
	lastTouched []string
}

func (w *writer) put(bucket []byte, key string, m proto.Message) {
	w.recordChange(bucket, key, m)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("raftstore: marshal %s/%s: %v", bucket, key, err))
	}
	w.must(w.tx.Bucket(bucket).Put([]byte(key), b))
}

func (w *writer) putRaw(bucket []byte, key, value string) {
	w.must(w.tx.Bucket(bucket).Put([]byte(key), []byte(value)))
}

func (w *writer) del(bucket []byte, key string) {
	w.recordChange(bucket, key, nil)
	w.must(w.tx.Bucket(bucket).Delete([]byte(key)))
}

// must panics on a bbolt write error: these fail only on programming
// errors (read-only tx, missing bucket) or a broken disk.
func (w *writer) must(err error) {
	if err != nil {
		panic(fmt.Sprintf("raftstore: fsm write: %v", err))
	}
}
