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
	// bucketVolumeSnapshots indexes snapshots by volume (snapshotsOf):
	// derived from bucketSnapshots, kept by writer.put and writer.del,
	// and rebuilt when a state file or image is opened without it or with
	// a count that disagrees (fsm.go, snapshotIndexAgrees).
	bucketVolumeSnapshots = []byte("volume_snapshots")

	// requiredBuckets must be in every state image; the buckets added
	// later (nodes, volume_snapshots) are created when a file or snapshot
	// from before them is opened.
	requiredBuckets = [][]byte{bucketMeta, bucketServers, bucketVolumes, bucketVolumeNames, bucketSnapshots, bucketSnapshotNames}
	allBuckets      = append(slices.Clone(requiredBuckets), bucketNodes, bucketEvents, bucketVolumeSnapshots)

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
	next, err := r.page(r.tx.Bucket(bucketVolumes).Cursor(), p, func(v []byte) (func(), error) {
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

// ListSnapshots is Snapshots bounded by a Page. With a volume id it walks
// that volume's part of the index only, so a page costs the same however
// many snapshots other volumes have; its tokens are snapshot ids as
// without one.
func (r *Reader) ListSnapshots(volumeID string, p Page) ([]*storpb.Snapshot, string, error) {
	var out []*storpb.Snapshot
	var c keyCursor = r.tx.Bucket(bucketSnapshots).Cursor()
	if volumeID != "" {
		c = r.snapshotsOf(volumeID)
	}
	next, err := r.page(c, p, func(v []byte) (func(), error) {
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

// snapshotCount counts the snapshots of one volume (from the index: it
// reads no snapshot record).
func (r *Reader) snapshotCount(volumeID string) (int, error) {
	n := 0
	c := r.snapshotsOf(volumeID)
	for k, _ := c.c.Seek(c.prefix); k != nil && bytes.HasPrefix(k, c.prefix); k, _ = c.c.Next() {
		n++
	}
	return n, nil
}

// snapshotIndexKey is snapshot id's key in bucketVolumeSnapshots: the
// length of volumeID (uvarint), volumeID, id. The length keeps one
// volume's keys apart from those of a volume whose id extends its id;
// within a volume the keys are in snapshot id order, as in
// bucketSnapshots.
func snapshotIndexKey(volumeID, id string) []byte {
	k := binary.AppendUvarint(nil, uint64(len(volumeID)))
	return append(append(k, volumeID...), id...)
}

// keyCursor walks keys in order, as a bbolt cursor does; page reads
// through it.
type keyCursor interface {
	First() (k, v []byte)
	Seek(seek []byte) (k, v []byte)
	Next() (k, v []byte)
}

// volumeSnapshots walks one volume's snapshots through the index, in
// snapshot id order: its keys are snapshot ids and its values their
// records.
type volumeSnapshots struct {
	c      *bolt.Cursor // over bucketVolumeSnapshots
	prefix []byte       // snapshotIndexKey(volume, "")
	snaps  *bolt.Bucket
}

func (r *Reader) snapshotsOf(volumeID string) *volumeSnapshots {
	return &volumeSnapshots{
		c:      r.tx.Bucket(bucketVolumeSnapshots).Cursor(),
		prefix: snapshotIndexKey(volumeID, ""),
		snaps:  r.tx.Bucket(bucketSnapshots),
	}
}

func (c *volumeSnapshots) First() ([]byte, []byte) { return c.record(c.c.Seek(c.prefix)) }
func (c *volumeSnapshots) Next() ([]byte, []byte)  { return c.record(c.c.Next()) }
func (c *volumeSnapshots) Seek(id []byte) ([]byte, []byte) {
	return c.record(c.c.Seek(append(slices.Clip(c.prefix), id...)))
}

func (c *volumeSnapshots) record(k, _ []byte) ([]byte, []byte) {
	if k == nil || !bytes.HasPrefix(k, c.prefix) {
		return nil, nil
	}
	id := k[len(c.prefix):]
	return id, c.snaps.Get(id)
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

// page walks c in key order after p.Token's key. match decides an
// entry: nil to skip it, else the function that takes it into the page
// (called only if it fits p's bounds).
func (r *Reader) page(c keyCursor, p Page, match func(v []byte) (func(), error)) (string, error) {
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
	// failedSnapshots holds the snapshots that failed in the command
	// being applied, by id (recordCloneFailures).
	failedSnapshots map[string]*storpb.Snapshot
}

func (w *writer) put(bucket []byte, key string, m proto.Message) {
	w.recordChange(bucket, key, m)
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		panic(fmt.Sprintf("raftstore: marshal %s/%s: %v", bucket, key, err))
	}
	w.must(w.tx.Bucket(bucket).Put([]byte(key), b))
	if s, ok := m.(*storpb.Snapshot); ok && bytes.Equal(bucket, bucketSnapshots) {
		// A snapshot's volume never changes: putting it again is a no-op.
		w.must(w.tx.Bucket(bucketVolumeSnapshots).Put(snapshotIndexKey(s.VolumeId, key), nil))
	}
}

func (w *writer) putRaw(bucket []byte, key, value string) {
	w.must(w.tx.Bucket(bucket).Put([]byte(key), []byte(value)))
}

func (w *writer) del(bucket []byte, key string) {
	w.recordChange(bucket, key, nil)
	if bytes.Equal(bucket, bucketSnapshots) {
		if s, err := w.Snapshot(key); err == nil {
			w.must(w.tx.Bucket(bucketVolumeSnapshots).Delete(snapshotIndexKey(s.VolumeId, key)))
		}
	}
	w.must(w.tx.Bucket(bucket).Delete([]byte(key)))
}

// must panics on a bbolt write error: these fail only on programming
// errors (read-only tx, missing bucket) or a broken disk.
func (w *writer) must(err error) {
	if err != nil {
		panic(fmt.Sprintf("raftstore: fsm write: %v", err))
	}
}
