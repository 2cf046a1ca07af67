package csi

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// maxListBytes bounds the entries of one List* response: a CO's gRPC
// client takes at most 4 MiB a message by default, and 50,000 snapshots
// are 5 MB as CSI entries. A page cut by it ends early with a next_token,
// also when max_entries is 0 (no limit asked): the CO follows next_token
// whenever it is set.
var maxListBytes = 1 << 20

// clusterPageSize is the most entries the controller asks of one cluster
// list call.
const clusterPageSize = 500

// The listings a token belongs to: a token of one is not one of another.
const (
	listVolumes   byte = 'v'
	listSnapshots byte = 's'
	listHealth    byte = 'h'
)

// tokenMagic starts every list token, after its base64 is undone.
const tokenMagic = "stor-csi-list1"

// listToken is where a CSI listing resumes: a starting_token, a
// next_token. The cluster lists volumes and snapshots in id order, and
// its page token resumes after the last id of the page that returned it.
// A CSI page ends after entry after, which came in the cluster's page
// read with token cluster; the next one reads that cluster page again and
// skips the ids up to after. So a CSI page costs about one cluster page
// more than its entries, and an entry deleted or created between pages
// moves no other: none is listed twice and none left out that existed
// throughout.
type listToken struct {
	kind    byte   // listVolumes, listSnapshots or listHealth
	filter  string // the listing's filter (listing.filter): a token is not one of another filter's listing
	cluster string // the cluster page token to read from; "" for the first page
	after   string // the last id listed: it and every id before it are skipped
}

// encode returns the token as the CO sees it: opaque, base64 (URL
// alphabet, no padding) of tokenMagic, kind, the filter's length
// (uvarint), the filter, the cluster token's length (uvarint), the
// cluster token and after.
func (t listToken) encode() string {
	b := append([]byte(tokenMagic), t.kind)
	b = binary.AppendUvarint(b, uint64(len(t.filter)))
	b = append(b, t.filter...)
	b = binary.AppendUvarint(b, uint64(len(t.cluster)))
	b = append(append(b, t.cluster...), t.after...)
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodeListToken decodes a starting_token of listing kind with filter;
// "" is the first page. Anything encode did not make for kind and filter
// is ErrToken.
func decodeListToken(kind byte, filter, s string) (listToken, error) {
	t := listToken{kind: kind, filter: filter}
	if s == "" {
		return t, nil
	}
	bad := fmt.Errorf("%w: starting token %s", ErrToken, quoteToken(s))
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err != nil || !strings.HasPrefix(string(b), tokenMagic) {
		return t, bad
	}
	b = b[len(tokenMagic):]
	if len(b) == 0 || b[0] != kind {
		return t, bad
	}
	b = b[1:]
	// field cuts a length-prefixed field off b.
	field := func() (string, bool) {
		n, w := binary.Uvarint(b)
		if w <= 0 || n > uint64(len(b)-w) {
			return "", false
		}
		f := string(b[w : w+int(n)])
		b = b[w+int(n):]
		return f, true
	}
	f, ok := field()
	if !ok {
		return t, bad
	}
	if f != filter {
		return t, fmt.Errorf("%w: starting token %s is of a listing with other filters", ErrToken, quoteToken(s))
	}
	if t.cluster, ok = field(); !ok {
		return t, bad
	}
	t.after = string(b)
	if t.after == "" {
		return t, bad // a token follows a listed entry
	}
	return t, nil
}

// quoteToken quotes a token for an error message, cut to 64 bytes (a CO
// could send megabytes).
func quoteToken(s string) string {
	if len(s) > 64 {
		return fmt.Sprintf("%q... (%d bytes)", s[:64], len(s))
	}
	return fmt.Sprintf("%q", s)
}

// listing is one cluster listing as a CSI list call reads it.
type listing[R any, E proto.Message] struct {
	kind byte
	// filter is what the request's filters select (ListSnapshots'
	// source_volume_id and snapshot_id), "" for none; its tokens carry it.
	filter string
	// list reads one page of the cluster's listing: up to size records
	// after token's position in id order, and the next page's token, ""
	// after the last.
	list func(ctx context.Context, token string, size uint32) ([]R, string, error)
	id   func(R) string
	// entry makes a record's CSI entry, or reports false to leave the
	// record out.
	entry func(R) (E, bool)
	// sparse: entry leaves most records out, so every cluster page is
	// asked at full size rather than at what max_entries still wants.
	sparse bool
}

// page answers one CSI list call: the entries after token's position,
// in id order, at most max (0: no limit) and maxListBytes encoded (at
// least one), and the next_token, "" after the last entry. It reads the
// cluster from the token's position on, and no further than the page
// needs.
func (l listing[R, E]) page(ctx context.Context, c *controllerServer, token string, max int32) ([]E, string, error) {
	if max < 0 {
		return nil, "", invalidf("max_entries %d is negative", max)
	}
	tok, err := decodeListToken(l.kind, l.filter, token)
	if err != nil {
		return nil, "", err
	}
	var out []E
	var size int
	var last string // the last id read from the cluster
	for {
		ask := uint32(clusterPageSize)
		if left := int(max) - len(out); max > 0 && !l.sparse && left < clusterPageSize {
			ask = uint32(left)
		}
		cctx, cancel := c.d.call(ctx)
		recs, next, err := l.list(cctx, tok.cluster, ask)
		cancel()
		switch {
		case err != nil && tok.cluster != "" && clusterCode(err) == codes.InvalidArgument:
			return nil, "", fmt.Errorf("%w: starting token %s: the cluster refuses its page token: %v", ErrToken, quoteToken(token), err)
		case err != nil:
			return nil, "", err
		}
		for i, r := range recs {
			id := l.id(r)
			if last != "" && id <= last {
				return nil, "", fmt.Errorf("%w: the cluster listed %q after %q", ErrClusterOrder, id, last)
			}
			last = id
			if id <= tok.after {
				continue // listed by an earlier page
			}
			e, ok := l.entry(r)
			if !ok {
				continue
			}
			n := protowire.SizeBytes(proto.Size(e)) + 1 // and its field tag
			if len(out) > 0 && size+n > maxListBytes {
				return out, tok.encode(), nil
			}
			out, size, tok.after = append(out, e), size+n, id
			if max > 0 && len(out) == int(max) {
				switch {
				case next == "" && !l.anyEntry(recs[i+1:]):
					return out, "", nil
				case i < len(recs)-1:
					return out, tok.encode(), nil
				}
				return out, listToken{kind: l.kind, filter: l.filter, cluster: next, after: id}.encode(), nil
			}
		}
		switch next {
		case "":
			return out, "", nil
		case tok.cluster:
			return nil, "", fmt.Errorf("%w: the cluster returned page token %q twice", ErrClusterOrder, next)
		}
		tok.cluster = next
	}
}

// anyEntry reports whether a record of recs makes an entry.
func (l listing[R, E]) anyEntry(recs []R) bool {
	for _, r := range recs {
		if _, ok := l.entry(r); ok {
			return true
		}
	}
	return false
}
