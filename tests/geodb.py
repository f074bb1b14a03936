"""MaxMind-format databases for the tests, written with mmdb-writer: an ASN
database and a Country database of documentation networks."""

from __future__ import annotations

from pathlib import Path

from mmdb_writer import MMDBWriter
from netaddr import IPSet

# network -> (autonomous system, organisation, country)
NETWORKS = {
    "203.0.113.0/24": (64500, "Example Hosting", "NL"),
    "198.51.100.0/24": (64501, "Campus Net", "DE"),
    "2001:db8::/32": (64502, "V6 Hosting", "US"),
    # The tests' own loopback clients, through the proxies.
    "127.0.0.0/8": (64510, "Loopback Cloud", "AQ"),
}


def write_asn_database(path: Path, networks: dict[str, tuple[int, str, str]] | None = None) -> Path:
    writer = MMDBWriter(ip_version=6, database_type="GeoLite2-ASN", ipv4_compatible=True)
    for network, (number, organisation, _) in (networks or NETWORKS).items():
        writer.insert_network(IPSet([network]), {"autonomous_system_number": number,
                                                 "autonomous_system_organization": organisation})
    writer.to_db_file(str(path))
    return path


def write_country_database(path: Path, networks: dict[str, tuple[int, str, str]] | None = None) -> Path:
    writer = MMDBWriter(ip_version=6, database_type="GeoLite2-Country", ipv4_compatible=True)
    for network, (_, _, country) in (networks or NETWORKS).items():
        writer.insert_network(IPSet([network]), {"country": {"iso_code": country, "names": {"en": country}}})
    writer.to_db_file(str(path))
    return path
